import sys
from pathlib import Path

# the spawned ranks import the worker modules of this directory by name
sys.path.insert(0, str(Path(__file__).resolve().parent))
