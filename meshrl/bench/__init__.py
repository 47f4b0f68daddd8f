"""Benchmarks behind `meshrl bench <name>`: JSON out, ratios against a baseline measured in the same run."""
