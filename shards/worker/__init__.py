"""The worker side: a rank's model runner, the shard actor that hosts it, and the
batcher's group of them."""
