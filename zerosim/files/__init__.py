"""Files and text (layer 0): where commands write, the data and settings files one process
leaves another, reading folders a user may not control, and the text a command prints or
parses (tables, terminal-safe text, integer expressions, dotted names).
"""
