"""Hardened execution of untrusted Python against test cases.

:class:`Sandbox` runs each candidate program in its own process with CPU, wall-clock,
address-space, file-size, open-file and process-count limits, a fresh private working
directory, a scrubbed environment, no network and a read-only, narrowed view of the
filesystem (Linux namespaces; clearly logged when unavailable). All tests of one candidate
run in one process; candidates run in parallel. Verdicts are computed in the parent from the
candidate's outputs, so tampering inside the sandbox cannot forge a pass.

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
