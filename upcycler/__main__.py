"""`python -m upcycler` is the `upcycle` command."""

from upcycler.cli import main

if __name__ == "__main__":
    main()
