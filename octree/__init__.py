"""Pure geometry of the scene's octree: keys, Morton codes, construction, boxes, culling, partition.

No I/O and no torch: numpy (and scipy's k-d tree for adjacency) only.
"""
from octree.assign import assign_points
from octree.bounds import extent_boxes, tight_boxes
from octree.boxes import box_box_distance, point_box_distance
from octree.build import Octree, build_octree, leaves_from_sorted_codes, locate
from octree.cull import frustum_cull
from octree.keys import BlockKey, parse_key
from octree.neighbours import neighbours
from octree.partition import partition, region_weights
from octree.root import RootCube

__all__ = [
    "BlockKey",
    "Octree",
    "RootCube",
    "assign_points",
    "box_box_distance",
    "build_octree",
    "extent_boxes",
    "frustum_cull",
    "leaves_from_sorted_codes",
    "locate",
    "neighbours",
    "parse_key",
    "partition",
    "point_box_distance",
    "region_weights",
    "tight_boxes",
]
