"""The Ray side: model replicas (plain classes + thin Ray actor wrappers)."""
