"""The pluggy markers of the ``lm_coupling`` project."""

import pluggy

PROJECT_NAME = "lm_coupling"

hookspec = pluggy.HookspecMarker(PROJECT_NAME)
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)
