"""``python cli.py ...`` from a checkout: the same command as the installed ``torch-handle``."""

from torch_handle.commands import start

if __name__ == "__main__":
    start()
