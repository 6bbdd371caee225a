import sys
from pathlib import Path

# dp_helpers must be importable by name in the spawned ranks too (they unpickle its functions).
sys.path.insert(0, str(Path(__file__).parent))
