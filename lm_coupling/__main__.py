"""``python -m lm_coupling`` == ``lm-coupling``."""

from lm_coupling.cli import main

main()
