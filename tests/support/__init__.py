"""Test helpers (tiny GGUF models, a drafter that fails on purpose), shared by the test suite and the
replica benchmark script; not part of the package."""
