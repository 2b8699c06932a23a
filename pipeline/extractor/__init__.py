"""The extractor's text protocol (`protocol`): distillation and merge prompts, the strict answer parser, and the ids
of the experience ops an answer becomes. No Kafka and no model here; `workers/extractor.py` runs it."""
