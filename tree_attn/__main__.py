"""``python -m tree_attn``: the command line."""

from tree_attn.cli.app import main

if __name__ == "__main__":
    main()
