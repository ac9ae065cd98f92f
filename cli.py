"""``python cli.py ...`` from a checkout: the same command as the installed ``torch-handle``."""

from torch_handle.cli import main

if __name__ == "__main__":
    main()
