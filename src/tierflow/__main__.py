"""``python -m tierflow ...`` runs the CLI, so ``torchrun ... -m tierflow train ...`` works."""

from .cli import main

if __name__ == "__main__":
    raise SystemExit(main())
