"""``python -m ft`` is the ``ft`` command."""

from ft.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
