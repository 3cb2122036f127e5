"""Test helpers shared by several test modules (no tests here): repositories and the shared quick run,
the loopback S3 server, fault-injection pieces, trainer material, process watching."""
