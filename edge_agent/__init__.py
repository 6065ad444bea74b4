"""The line agent service: ingest, result writer, metrics, replay client, demo and CLI."""
