# The io_uring disk engine's test links liburing when this build found it.
if(TARGET test_uring_copy_engine AND TARGET chunkstar::uring)
  target_link_libraries(test_uring_copy_engine PRIVATE chunkstar::uring)
endif()
