"""``python -m weightsync.demo``: the main job (see ``weightsync.demo``)."""

from weightsync.demo.cli import main

raise SystemExit(main())
