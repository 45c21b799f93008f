"""Benchmarks: `python -m tools.bench NAME [options]`, one module per NAME, each with `main(argv)`."""
