"""The Runner's parts, one job a module (issue #21): ``boundloop.runner`` assembles them."""
