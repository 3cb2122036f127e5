def main(): raise SystemExit('vpo CLI: under construction')
