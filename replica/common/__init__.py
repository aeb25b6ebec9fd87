"""What every floor shares of one replica: the config rules (`rules`), the wire types that cross the replica's
boundary (`types`: engine config, requests, results) and the metric labels (`metric_labels`)."""
