#!/usr/bin/perl

# The isolation review: a large store file is deleted in steps (renamed to
# ".del", cut by 64 MB every 10 ms) where the store's calls run in the
# event loop (thread_pool=off, or an nginx without threads); in threads
# (the default) it is deleted by its name.  A llama-server (the folder's owner)
# that swaps that name for a link must not make the worker (www-data) cut
# the file the link points at: it is cut through a descriptor of the very
# file renamed (O_NOFOLLOW, the same inode), else only the name goes.

use strict;
use warnings;

use FindBin;
use lib "$FindBin::Bin/lib";

use LlamaTest;
use Test::More;

my $t = LlamaTest->new(workers => 2);
$t->fake(np => 1);
$t->nginx($t->site(
    zone => 'llama_session_zone zone=llama:1m store=%%SLOTS%%;',
    extra => 'location /api/ { llama_session_api llama; }'));

# with the store's calls in threads (the default), a large file is
# deleted by its name in a thread: a link never is followed, nothing is
# cut, the worker is not held
{
    my $big = "$t->{slots}/big-" . ('9' x 24) . '.' . LlamaTest::fake_fp()
              . '.bin';
    open my $fh, '>', $big or die;
    truncate $fh, 4 * 1024 * 1024 * 1024 or die;
    close $fh;
    is($t->post('/completion', { prompt => 'x', n_predict => 2 },
                headers => { 'X-Session-Id' => 'warmup' })->{status}, 200,
       'threads: the zone knows the backend');
    is($t->get('/api/sessions')->{status}, 200, 'threads: the folder is read');
    is($t->request('DELETE', '/api/sessions/big-' . ('9' x 24))->{status},
       200, 'threads: DELETE a 4 GB file');
    ok($t->wait_for(sub { !-e $big && !glob("$big*") }, 10),
       'threads: it goes, no .del name');
}
$t->stop;

# thread_pool=off: the store's calls in the event loop, the large file
# cut in steps there
$t = LlamaTest->new(workers => 2);
$t->fake(np => 1);
$t->nginx($t->site(
    zone => 'llama_session_zone zone=llama:1m store=%%SLOTS%% '
            . 'thread_pool=off;',
    extra => 'location /api/ { llama_session_api llama; }'));

my $slots = $t->{slots};
my $fp = LlamaTest::fake_fp();
my $key = 'big-' . ('0' x 24);
my $file = "$slots/$key.$fp.bin";
my $size = 4 * 1024 * 1024 * 1024;

# a 4 GB state (sparse), known to the zone
open my $fh, '>', $file or die;
truncate $fh, $size or die;
close $fh;

# a file the workers may write, which the link will point at
my $victim = $t->dir . '/victim.log';
open $fh, '>', $victim or die;
truncate $fh, $size or die;
close $fh;
my $uid = (getpwnam($LlamaTest::USER))[2];
chown $uid, -1, $victim;

is($t->post('/completion', { prompt => 'x', n_predict => 2 },
            headers => { 'X-Session-Id' => 'warmup' })->{status}, 200,
   'the zone knows the backend');
my $r = $t->get("/api/sessions/$key");
is($r->{status}, 200, 'the 4 GB file is in the index');

$r = $t->request('DELETE', "/api/sessions/$key");
is($r->{status}, 200, 'DELETE it');

# the name it was renamed to becomes a link to the victim
my $del = "$file.del";
ok(-e $del, 'it was renamed to .del, to be cut in steps');
symlink $victim, "$del.link" or die;
rename "$del.link", $del or die;

ok($t->wait_for(sub { !-e $del && !-l $del }, 10), 'the .del name goes');
is(-s $victim, $size, 'the file the link pointed at is whole');
ok($t->log_lines(qr/is no longer the file the module renamed/),
   'the error log says why only the name went');

# a save's .tmp that llama-server wrote after its client left: reaped
# while running once nothing wrote to it for 10 minutes; a fresh one stays
my $old = "$slots/gone-" . ('1' x 24) . ".$fp.bin.tmp";
my $new = "$slots/busy-" . ('2' x 24) . ".$fp.bin.tmp";
for ($old, $new) { open my $f, '>', $_ or die; print $f 'x' x 100; close $f }
utime time - 1200, time - 1200, $old;
is($t->get('/api/sessions')->{status}, 200, 'the folder is looked at again');
ok(!-e $old, 'a .tmp left for 20 minutes is deleted');
ok(-e $new, 'a fresh one stays');

$t->stop;
done_testing;
