"""`python -m services.cli` runs `mj`."""

from services.cli.main import main

if __name__ == "__main__":
    main()
