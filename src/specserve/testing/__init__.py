"""Test helpers shipped in the package so that unit tests, server tests and benchmarks can share them."""
