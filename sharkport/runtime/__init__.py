"""Running models: IREE and eager sessions, page allocation, the generate loop."""
