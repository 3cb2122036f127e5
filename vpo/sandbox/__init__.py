"""Hardened execution of untrusted Python against test cases.

:class:`Sandbox` runs each candidate program in its own process with CPU, wall-clock,
address-space, file-size, open-file and process-count limits, a fresh private working
directory, a scrubbed environment, no network, a minimal read-only nodev view of the filesystem
(dataset files hidden by their own paths), a fresh session keyring and a seccomp system-call
filter (Linux namespaces; clearly logged when unavailable). All tests of one candidate run in
one process; candidates run in parallel, each forked from a server that never held another
candidate's data. Verdicts are computed in the parent from the candidate's plain outputs, with
the source dataset's own rules (exact or tolerant equality, ``is``/truthiness checks, one time
budget per problem, the dataset's own test code in a separate judge sandbox), so tampering inside
the sandbox cannot forge a pass, and whatever a candidate returns or writes becomes its own
verdict, never a failure of the batch.

Standard library only, so it also runs under a bare system interpreter.
"""

from vpo.sandbox._harness import CodecError, decode_value, encode_value
from vpo.sandbox.compare import stdout_matches, values_match
from vpo.sandbox.runner import (
    DEFAULT_PRELUDE,
    CandidateResult,
    Job,
    Sandbox,
    SandboxConfig,
    SandboxError,
    Status,
    TestCase,
    TestResult,
    default_hide_paths,
    private_view_available,
)

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
    "decode_value",
    "default_hide_paths",
    "encode_value",
    "private_view_available",
    "stdout_matches",
    "values_match",
]
