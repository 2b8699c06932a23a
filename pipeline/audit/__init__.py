"""Reading a run back: the Parquet archive layout (`archive`), the DuckDB views over it (`views`), the report
(`report`), and both replays, of the experience bank (`bank_replay`) and of training (`training_replay`)."""
