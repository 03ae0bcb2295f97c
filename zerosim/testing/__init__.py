"""Test helpers for users of zerosim: hypothesis strategies (``zerosim.testing.strategies``).

Importing ``zerosim.testing.strategies`` needs hypothesis (``pip install zerosim[test]``); importing
``zerosim`` itself never does.
"""
