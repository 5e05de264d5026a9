"""The live GPU check (device_check.sh, device_check.py) and the trimmed sdist it builds from."""
