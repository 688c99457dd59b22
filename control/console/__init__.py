"""The operator console in the browser (``loraplane console``): adapter lifecycles, rollouts
live with their pause/resume/abort buttons, hosts, incident search with CSV/JSON export, and
the audit status, for operators only. See :mod:`control.console.app`."""
