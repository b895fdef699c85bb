"""CLI subcommands; see moerun/cli.py for the contract each module follows."""
