"""What several test modules share and is not a fixture: oracles (oracle.py), runs of the CLI that crash or are
stopped (crash.py), tiny runs' configs and what they wrote (runs.py), generated doc blocks (generated.py), the
family sweep (family_sweep.py) and its tiny configs of any model type (tiny_configs.py). Imported as
`helpers.<module>` (pytest's pythonpath holds tests/).
"""
