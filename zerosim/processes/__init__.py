"""Processes (layer 3): launches as process groups with timeouts, every process a command
owns, stop signals, each rank's log and the messages a rank prints.
"""
