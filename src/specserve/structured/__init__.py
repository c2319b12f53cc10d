"""Structured outputs: grammars (JSON Schema, regex, choice, Lark/GBNF) compiled by llguidance, and each
constrained request's grammar state, which masks its target rows and drafts the tokens it forces.

llguidance (a Rust library on PyPI, llama.cpp's and vLLM's grammar engine) is imported only when a request
asks for a structured output; a server that never gets one never loads it.
"""
