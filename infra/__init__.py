"""Infrastructure: embedded broker, Kafka clients and admin, database engine and migrations."""
