"""Hostile-input fuzzing of a running jaxserve server over both interfaces (tests/server/test_fuzz.py runs a bounded
set; tools/checks/fuzz_server.py runs thousands)."""
