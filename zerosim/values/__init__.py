"""Values and plans (layer 0): dtypes, presets, layouts, strategies and topologies,
intervals, plans and flat units, unit states, observations, verdicts and run values.
Plain data, no arrays.
"""
