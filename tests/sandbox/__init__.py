"""Local stand-ins for what this machine lacks (TEST CODE, never imported by product code).

`python -m tests.sandbox <command>`; see `__main__.py` for the commands.
"""
