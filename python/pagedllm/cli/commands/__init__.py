"""One module per subcommand of `pagedllm`, each with its parser (`add_parser`) and what it runs
(`run`); `cli/app.py` wires them together."""
