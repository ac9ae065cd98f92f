"""Lightning callbacks for torch-handle runs."""
