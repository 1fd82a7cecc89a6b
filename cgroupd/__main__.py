"""``python -m cgroupd``: the same command line as the ``cgroupd`` console script."""

from cgroupd.cli import main

if __name__ == "__main__":
    main()
