"""The runtime: settings, worker runner, transports, audit, CLI."""
