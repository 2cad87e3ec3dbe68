"""`python -m actors.model.kernels`: build this machine's kernels now (make setup), exit 1 where they cannot be."""
import logging

from actors.model.kernels import available

logging.basicConfig(level=logging.INFO)
raise SystemExit(0 if available() else 1)
