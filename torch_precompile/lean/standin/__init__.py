"""A model's configuration, weights and attributes without its class."""
