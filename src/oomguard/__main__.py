"""``python -m oomguard``: the same as the ``oomguard`` command."""

from oomguard.cli import main

raise SystemExit(main())
