"""The network model below both drivers: links (bandwidth, latency, outages, routes), their shaping on the real clock, and where fragments' home shards run."""
