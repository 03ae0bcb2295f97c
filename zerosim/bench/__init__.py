"""Benchmarks behind ``zerosim bench``."""
