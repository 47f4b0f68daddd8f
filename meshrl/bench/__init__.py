"""Benchmarks behind `meshrl bench <name>` (JSON out, ratios to an in-run baseline)."""
