#!/bin/bash
# Kafka's own kafka-broker-api-versions.sh, for health checks: exits 0 once the broker answers ApiVersions.
#   kafka-broker-api-versions.sh --bootstrap-server localhost:19092
exec java -Xmx128m -XX:TieredStopAtLevel=1 -XX:+UseSerialGC -Dlog4j2.configurationFile=/opt/kafka/config/log4j2.properties \
  -cp '/opt/kafka/libs/*' org.apache.kafka.tools.BrokerApiVersionsCommand "$@"
