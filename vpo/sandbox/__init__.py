"""Hardened execution of untrusted Python against test cases.

:class:`Sandbox` runs each candidate program in its own process tree with a cgroup (memory
including tmpfs and shared memory, a process count, a CPU quota), time limits charged in the
candidate's own CPU time with a wall-clock ceiling, file-size and open-file limits, a fresh
private working directory, a scrubbed environment, no network, a minimal read-only nodev view of
the filesystem (dataset files hidden by their own paths), a fresh session keyring, its own user
id and a seccomp system-call filter. It **fails closed**: a protection that cannot be set up
refuses the candidate, unless a named setting accepts running without it
(:mod:`vpo.sandbox.config`). All tests of one candidate run in one process; candidates run in
parallel, each forked from a server that never held another candidate's data. Verdicts are
computed in the parent from the candidate's plain outputs, with the source dataset's own rules
(:mod:`vpo.sandbox.judging`), so tampering inside the sandbox cannot forge a pass, and whatever a
candidate returns or writes becomes its own verdict, never a failure of the batch.

Modules, by job: ``config`` (settings, test cases, results, protections), ``pool`` (the
fork-server pool and :class:`Sandbox`), ``channel`` (reading and decoding results, time charged),
``judging`` (one candidate's tests and verdicts), ``cgroups``, ``leases`` (user ids), ``compare``
(value and output rules) and ``_harness`` (the in-sandbox side, a standalone script). Standard
library only inside the sandbox.
"""

from vpo.sandbox._harness import CodecError, decode_value, encode_value
from vpo.sandbox.compare import stdout_matches, values_match
from vpo.sandbox.config import (
    DEFAULT_PRELUDE,
    CandidateResult,
    Job,
    SandboxConfig,
    SandboxError,
    Status,
    TestCase,
    TestResult,
    benchmark_payloads,
    default_hide_paths,
)
from vpo.sandbox.pool import Sandbox, private_view_available

__all__ = [
    "DEFAULT_PRELUDE",
    "CandidateResult",
    "CodecError",
    "Job",
    "Sandbox",
    "SandboxConfig",
    "SandboxError",
    "Status",
    "TestCase",
    "TestResult",
    "benchmark_payloads",
    "decode_value",
    "default_hide_paths",
    "encode_value",
    "private_view_available",
    "stdout_matches",
    "values_match",
]
