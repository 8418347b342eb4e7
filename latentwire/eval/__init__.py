"""The evaluation: what the wire carries, against the text it replaces and its controls. A tool
above the library: train.py (--eval-every) and `python -m latentwire.evaluate` use it."""
