"""``python cli.py ...`` from a checkout: the same command as the installed ``torch-handle``."""

from torch_handle.cli import command

if __name__ == "__main__":
    command()
