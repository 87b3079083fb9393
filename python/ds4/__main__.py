"""``python -m ds4`` is the ``ds4`` command."""

from .cli import main

if __name__ == "__main__":
    raise SystemExit(main())
